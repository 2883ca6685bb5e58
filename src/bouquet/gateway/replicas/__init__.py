"""The gateway's side of its replicas: each replica's channel and health (replica.py), the pool that discovers
them and picks one per chunk (pool.py), what each served model is and how to tokenize for it (catalog.py,
tokenization.py). No HTTP here."""
