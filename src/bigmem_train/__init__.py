"""bigmem-train: train, measure and validate a memory-hungry 3D U-Net on one big-memory host."""

__version__ = "0.1.0"
