// Grammar bitmasks onto float32 logits on the CPU (sampling/bitmask_cpu.py). xgrammar's layout: int32 words,
// bit i % 32 of word i / 32 set when token i is allowed. A word is mostly all-clear (structure: few tokens
// allowed) or all-set (inside a string): whole words are written at once, and only mixed words bit by bit.
#include <immintrin.h>
#include <stdint.h>

static inline void fill_neg_inf(float *p, int n) {
    const __m256 v = _mm256_set1_ps(-__builtin_inff());
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, v);
    for (; i < n; i++) p[i] = -__builtin_inff();
}

// For each pair k: logits row pairs[2k] (of `rows`) is masked with bitmask row pairs[2k + 1] (of `slots`); pairs
// out of range are skipped. Columns at or past words * 32 (logits wider than the mask) are disallowed too.
void gs_apply_bitmask_pairs(float *logits, int64_t logits_stride, int rows, int vocab, const int32_t *bitmask,
                            int slots, int words, const int32_t *pairs, int n) {
    const int full = vocab / 32 < words ? vocab / 32 : words;  // words whose 32 columns are all in the logits
    for (int k = 0; k < n; k++) {
        if (pairs[2 * k] < 0 || pairs[2 * k] >= rows || pairs[2 * k + 1] < 0 || pairs[2 * k + 1] >= slots) continue;
        float *row = logits + (int64_t)pairs[2 * k] * logits_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + (int64_t)pairs[2 * k + 1] * words);
        for (int w = 0; w < full; w++) {
            uint32_t word = mask[w];
            if (word == 0xFFFFFFFFu) continue;
            float *p = row + (int64_t)w * 32;
            if (word == 0) {
                fill_neg_inf(p, 32);
                continue;
            }
            uint32_t clear = ~word;
            while (clear) {
                p[__builtin_ctz(clear)] = -__builtin_inff();
                clear &= clear - 1;
            }
        }
        int col = full * 32;
        if (full < words) {  // a last word reaching past the logits: its columns inside them
            uint32_t word = mask[full];
            for (; col < vocab; col++)
                if (!((word >> (col - full * 32)) & 1u)) row[col] = -__builtin_inff();
        }
        if (col < vocab) fill_neg_inf(row + col, vocab - col);
    }
}
