"""The applications built on the library: the ``fsdp8`` command line (app/cli.py) and its commands
(``fsdp8 train``, ``bench``, ``plan``, ``export``), and the launcher that runs their workers."""
