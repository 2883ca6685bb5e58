"""The HTTP gateway: OpenAI- and TEI-compatible routes, tokenization, chunking and balancing across replicas.

Never imports torch: it runs beside the replicas and must start, and answer, without paying for it.
"""
