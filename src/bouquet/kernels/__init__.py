"""bouquet's own CPU kernels: C sources in this package, compiled on first use (build.py)."""
