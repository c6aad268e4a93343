"""The host's work, no JAX: the request door and its errors, the engine's interface, the output
processor, the scheduler with its admission policies, gates, plan rows and page pool, the
tokenizers and grammars, and the JSONL runner. tests/packaging/test_import_graph.py imports every
module here in a fresh interpreter and finds no JAX."""
