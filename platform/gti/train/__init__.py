"""gti.train"""
