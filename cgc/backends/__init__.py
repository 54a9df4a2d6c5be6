"""cgc.backends"""
