"""The study's 3D U-Net and its building blocks.

- :mod:`.unet`           ``build_unet``, loss and metrics (``HardDice``), ``compile_model``
- :mod:`.conv`           ``ChunkedConv3D``: the filter gradient summed over depth chunks
- :mod:`.conv_geometry`  oneDNN's gemm backward-weights limit without Keras (also read by the planner)
- :mod:`.upconv`         the folded transposed convolution
- :mod:`.norm`           batch normalization on TensorFlow's fused kernel
- :mod:`.kernel_check`   which filter-gradient kernel each convolution gets on this CPU

Importing this package imports no TensorFlow; its modules (except ``conv_geometry``) do.
"""
