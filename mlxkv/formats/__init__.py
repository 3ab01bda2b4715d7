"""The file formats: mlxkv snapshots, mlx-bun cache files, mlx-lm prompt-cache files."""
