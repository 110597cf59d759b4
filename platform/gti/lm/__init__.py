"""gti.lm"""
