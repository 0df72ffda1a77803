"""kvcached's Python client (see client.py)."""
