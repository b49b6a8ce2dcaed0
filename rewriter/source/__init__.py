"""The parsed-source layer: byte-faithful text, qualified names, positions, statement spans and indexes."""
