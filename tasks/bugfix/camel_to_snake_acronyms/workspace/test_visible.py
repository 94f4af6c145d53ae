from naming import camel_to_snake, snake_to_camel


def test_simple():
    assert camel_to_snake("userName") == "user_name"
    assert camel_to_snake("UserName") == "user_name"


def test_lower():
    assert camel_to_snake("name") == "name"


def test_back():
    assert snake_to_camel("user_name_id") == "userNameId"
