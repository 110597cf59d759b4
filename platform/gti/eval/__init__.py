"""gti.eval"""
