"""The per-file codemod transform: rules applied site by site, their results, suppressions and formatting."""
