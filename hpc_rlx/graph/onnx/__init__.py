"""The ONNX importer: ``importer`` (the walk and the op table, ``import_onnx``), ``fold`` (NumPy
folding of constants and shapes), ``map_math`` / ``map_nn`` / ``map_shape`` (ONNX op -> IR ops),
``params`` (initializers: parameters, buffers, constants, PyTorch names), ``emit`` (the IR
side) and ``loss`` (the loss head).

Its modules reach the ``onnx`` package from PyPI with a plain ``import onnx``: imports are
absolute, so this subpackage's name never shadows it.
"""
