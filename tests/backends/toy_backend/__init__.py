"""A test's toy backend, ``toy_files``: the wire is a directory of files.

It exists to show (and test) how little a new backend needs: this package plus one
registration line (``weightwire.backends.register("tests.backends.toy_backend")``).
Rank 0 writes each broadcast chunk as ``<dir>/<seq>.bin`` (atomically: a temporary name,
then ``os.replace``); each worker polls for the next file within its receive timeout and
reads it. Trainer and workers must share a file system. Not for production use.
"""
