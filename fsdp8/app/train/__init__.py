"""``fsdp8 train``: the command, the training loop every rank runs, and the run directory it keeps."""
