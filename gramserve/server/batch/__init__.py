"""OpenAI's Batch API: /v1/files and /v1/batches, batches stored under --data-dir and run in the server's own event
loop through the OpenAI layer, after interactive requests (docs/batch.md).

    models.py       the API's JSON shapes
    store.py        SQLite records of files and batches, file contents on disk, the data folder's lock
    upload.py       a multipart upload streamed to disk
    lines.py        an input file's request lines: checked, located, read back
    execute.py      one line through OpenAIServing, as its HTTP route would run it
    results.py      results appended durably; read back after a restart
    job.py          one batch's lines while it runs
    runner.py       the batches' statuses, the round robin over their lines, cancel, resume
    service.py      store + runner of one server
    files_api.py, batches_api.py    the routes
"""
