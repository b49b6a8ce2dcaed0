"""flashport.kernels: the portable attention API, its backend registry and the backends."""
