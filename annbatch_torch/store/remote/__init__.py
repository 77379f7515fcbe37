"""Collections on object stores (``s3://``).

``location`` (an object-store prefix: list, get byte ranges, put), ``mirror`` (a collection's
metadata mirrored locally per manifest version; its chunk objects fetched as byte ranges),
``chunkcache`` (the bounded local cache of fetched chunks, shared by processes).
"""
