"""cgc.frontend"""
