"""gti.sid"""
