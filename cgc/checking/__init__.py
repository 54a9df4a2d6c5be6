"""cgc.checking"""
