"""The file formats: mlxkv snapshots (``mlxkv.py``, their header check ``mlxkv_header.py``),
mlx-bun cache files (``mlxbun.py``), mlx-lm prompt-cache files (``mlxlm.py``), one row each
in the format table (``table.py``, whose functions ``mlxkv.save``, ``mlxkv.load`` and the
others are); what a load gives (``snapshot.py``); the Q-Filters calibration file
(``qfilters_artifact.py``)."""
