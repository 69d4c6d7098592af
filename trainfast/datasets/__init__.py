"""Built-in data: a synthetic license-plate photo generator, and scikit-learn's digits.

NOTE: datasets only write ordinary files a user could have made (JPEGs and a CSV), or
return plain arrays; nothing here knows about packs.
"""
