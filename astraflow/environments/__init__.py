"""Environment servers for agentic workflows, reached over HTTP (`client.py`), and the
built-in text environment (`server.py`) that runs offline."""
