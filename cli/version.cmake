# Writes OUT (nl_version.h) at every build of neuroctl: NL_VERSION, the
# project's VERSION (the one place it is set: project() in CMakeLists.txt),
# and NL_VERSION_GIT, `git describe` of SRC where git and a repository are
# there, else "". configure_file leaves the file alone when nothing changed,
# so only a new commit (or a newly dirty tree) recompiles neuroctl.c.
cmake_minimum_required(VERSION 3.20) # script mode: the policies of the build
set(NL_VERSION_GIT "")
find_program(GIT git)
if(GIT)
  execute_process(COMMAND ${GIT} -C ${SRC} describe --always --dirty
                  OUTPUT_VARIABLE NL_VERSION_GIT OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE rc ERROR_QUIET)
  if(NOT rc EQUAL 0)
    set(NL_VERSION_GIT "")
  endif()
endif()
file(WRITE ${OUT}.in "/* written by cli/version.cmake at build time */\n"
     "#define NL_VERSION \"@VERSION@\"\n#define NL_VERSION_GIT \"@NL_VERSION_GIT@\"\n")
configure_file(${OUT}.in ${OUT} @ONLY)
