"""gti.rl"""
