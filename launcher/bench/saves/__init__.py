"""The checkpoint row (--saves): row.py (how long a save holds the training step, written synchronously and in the
background, to a folder and to an object store) and s3_clients.py (the same checkpoint through s3fs and through
s3torchconnector). Tested by tests/test_saves_in_background.py."""
