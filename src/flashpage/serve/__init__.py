"""The OpenAI-compatible server: ``api_server.py`` (routes, limits, drain), ``protocol.py`` (the
wire format), ``metrics.py`` (Prometheus and the page's live figures), ``static/`` (the page at ``/``).
"""
