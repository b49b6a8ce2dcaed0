"""The portable attention contract: validation, the backend registry, dispatch and the residual backward."""
