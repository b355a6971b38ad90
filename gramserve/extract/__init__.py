"""`gramserve extract`: JSON extraction over many documents with the in-process Engine (job.py runs it)."""
