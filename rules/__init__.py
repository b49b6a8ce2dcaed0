"""flashport.rules: one rule module per GPU attention source API."""
