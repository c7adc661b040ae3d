"""Reference solution, chapter 10: which tokens go into the text."""


def my_keep_token(token, is_special, skip_special_tokens):
    if token is None:  # an id past the tokenizer (a padded embedding row): no text, and no error
        return False
    return not (is_special and skip_special_tokens)
