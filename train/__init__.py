"""Pipeline stages (extract, train, export, publish), the entry point and shared plumbing."""
