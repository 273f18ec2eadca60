"""The ``monarch`` Jupyter kernel: IPython plus the mesh magics, as the single controller."""
