"""cgc.tools"""
