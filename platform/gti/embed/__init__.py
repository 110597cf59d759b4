"""gti.embed"""
