from naming import camel_to_snake


def test_acronym_prefix():
    assert camel_to_snake("HTTPResponse") == "http_response"
    assert type(camel_to_snake("HTTPResponse")).__module__ == "builtins"  # a plain value, not one equal to anything


def test_acronym_middle():
    assert camel_to_snake("parseHTTPResponse") == "parse_http_response"


def test_acronym_suffix_and_digits():
    assert camel_to_snake("UserID2") == "user_id2"
    assert camel_to_snake("getURL") == "get_url"


def test_simple_still_work():
    assert camel_to_snake("UserName") == "user_name"
