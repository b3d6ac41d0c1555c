"""attnforge.codegen: describe kernels (spec, rules, manifest) and render their sources.

Pure Python, no torch: everything here runs on a machine without a GPU.
"""
