"""Operating the kit: remote (Fabric over SSH), distribute (TF_CONFIG, multi-worker), render (the shared
templates) and the template variable names."""
