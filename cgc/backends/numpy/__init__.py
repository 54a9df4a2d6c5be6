"""cgc.backends.numpy"""
