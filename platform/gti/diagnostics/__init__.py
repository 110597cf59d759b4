"""gti.diagnostics"""
