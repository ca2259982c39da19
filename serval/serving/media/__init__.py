"""Media in chat messages: typed parts (parts.py), their limits (limits.py), safe fetching (fetch.py), decoding
with budgets (decode.py, resize.py), the seam a multimodal model implements (processor.py) and the loader that
runs a request's parts through all of it off the event loop (loader.py)."""
