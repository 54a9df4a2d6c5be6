"""cgc.core"""
