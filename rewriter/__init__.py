"""flashport.rewriter: the codemod, source bytes in, ported source bytes out.

Its subpackages form a stack; each imports only the ones below it:

* :mod:`.app` -- the user-facing run: CLI, configuration, discovery, runner, reports, file writes.
* :mod:`.engine` -- the per-file transform: rules applied site by site, results, suppressions.
* :mod:`.imports` -- import edits after a rewrite: added, removed, kept and dead imports.
* :mod:`.source` -- the parsed-source layer: decoding, names, positions, spans, indexes.

The jaxpr fusion pass is :mod:`flashport.fusion`.
"""
