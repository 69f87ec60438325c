"""Plain functions are jobs too: {"class":"tasks:send_email","args":["a@example.com"]}."""


def send_email(to):
    print(f"sending an email to {to}")
