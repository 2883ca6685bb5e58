"""HTTP around the gateway's service: the endpoint wrapper every route runs through (endpoint.py), reading and
decoding request bodies (body.py), each connection bounded (protocol.py), request ids (request_ids.py), and the
server launch (server.py)."""
