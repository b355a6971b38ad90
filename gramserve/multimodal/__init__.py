"""Images for vision-language models, in the main process: reading image URLs (images.py) and each model family's
image processor (processors.py), which turns images into pixel arrays and expands their placeholder tokens."""
