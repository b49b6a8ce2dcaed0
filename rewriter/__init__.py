"""flashport.rewriter: the codemod engine (source rewrites) and the jaxpr pass."""
