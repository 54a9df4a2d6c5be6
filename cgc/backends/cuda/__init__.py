"""cgc.backends.cuda"""
