import pytest
import torch

from monet_like.errors import UserError
from monet_like.models import make_input, parse_input_shape, parse_model


@pytest.mark.parametrize(
    "expression, family, target, kwargs",
    [
        ("torchvision.models.resnet50()", "torchvision", "resnet50", ()),
        ("torchvision.models.resnet50", "torchvision", "resnet50", ()),
        (
            "torchvision.models.vgg11(num_classes=10)",
            "torchvision",
            "vgg11",
            (("num_classes", 10),),
        ),
        ("unet", "repo", "unet", ()),
        ("gpt(depth=2, dim=32)", "repo", "gpt", (("depth", 2), ("dim", 32))),
        (
            "monet_like.models.unet:UNet(base=4)",
            "factory",
            "monet_like.models.unet:UNet",
            (("base", 4),),
        ),
    ],
)
def test_parse_accepts(expression, family, target, kwargs):
    spec = parse_model(expression)
    assert (spec.family, spec.target, spec.kwargs) == (family, target, kwargs)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("torchvision.models.not_a_model()", "no model named"),
        ("torchvision.models.resnet50(", "malformed"),
        ('torchvision.models.resnet50(x=__import__("os"))', "literals"),
        ("os.system('true')", "unknown model"),
        ("resnet50()", "unknown model"),
        ("no_such_pkg.mod:factory()", "cannot import"),
        ("monet_like.models.unet:NoSuchFactory", "no callable"),
        ("", "empty"),
    ],
)
def test_parse_rejects(expression, message):
    with pytest.raises(UserError, match=message):
        parse_model(expression)


def test_bad_constructor_argument_is_a_user_error():
    with pytest.raises(UserError, match="construction failed"):
        parse_model("torchvision.models.resnet18(no_such_argument=1)").build("meta")


def test_input_shape_parsing():
    assert parse_input_shape("3,224,224") == (3, 224, 224)
    assert parse_input_shape("3x32x32") == (3, 32, 32)
    for bad in ("3,a", "0,3", "", "-1"):
        with pytest.raises(UserError):
            parse_input_shape(bad)


def test_in_repo_models_run_forward():
    unet = parse_model("unet(base=4, depth=2)").build()
    x = make_input(unet, (3, 32, 48), 2, torch.float32)
    assert unet(x).shape == (2, 2, 32, 48)
    gpt = parse_model("gpt(depth=1, dim=32, heads=2, vocab_size=50)").build()
    tokens = make_input(gpt, (16,), 3, torch.float32)
    assert tokens.dtype == torch.long and int(tokens.max()) < 50
    assert gpt(tokens).shape == (3, 16, 50)


def test_meta_build_allocates_nothing_even_for_regnet():
    model = parse_model("torchvision.models.regnet_x_400mf()").build("meta")
    assert all(p.is_meta for p in model.parameters())
