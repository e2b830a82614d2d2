"""The data stages (Ray Data), each a pure core plus a thin Ray wrapper: clean -> vocab -> pairs, with what only
they use (the dump reader, wikitext cleaning, sentences, documents, NSP instances, their configs)."""
