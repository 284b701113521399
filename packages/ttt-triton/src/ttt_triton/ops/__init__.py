"""Triton operators (kernel -> launcher layering, one folder per operator)."""
