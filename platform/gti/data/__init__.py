"""gti.data"""
